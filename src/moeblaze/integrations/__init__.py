"""Backends for other libraries' MoE models: `moeblaze.integrations.transformers` (Hugging Face transformers'
experts interface) and `moeblaze.integrations.torchtitan` (a torchtitan model converter). Nothing here is imported
by `import moeblaze`: each integration imports its library."""
