"""Every environment variable moeblaze reads, read once, when moeblaze is imported.

    TRITON_INTERPRET=1   Triton's CPU interpreter runs the kernels (tests). Triton itself reads it when it is
                         imported, so set it before importing moeblaze (or triton); moeblaze follows the value
                         seen at its own import, and later changes of the variable change nothing.
    MOEBLAZE_GLUON=0     backend="auto" runs the tl kernels on Hopper too (the Gluon kernels stay available
                         through backend="gluon").
"""
from __future__ import annotations

import os

INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"
GLUON_BY_DEFAULT: bool = os.environ.get("MOEBLAZE_GLUON", "1") != "0"
