"""Backends for other libraries' MoE models: `moeblaze.integrations.transformers` (Hugging Face transformers'
experts interface). Nothing here is imported by `import moeblaze`: each integration imports its library."""
