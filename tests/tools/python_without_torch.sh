#!/bin/sh
# Stands for an interpreter without PyTorch: it fails as python3 does on `import torch` then.
echo "Traceback (most recent call last):" >&2
echo "ModuleNotFoundError: No module named 'torch'" >&2
exit 1
