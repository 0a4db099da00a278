import os
import sys

# Triton must see this before it is imported anywhere (kernels/_triton.py does the same).
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
