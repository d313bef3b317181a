import os

# No GPU on the development and CI machines: Triton kernels run under the interpreter, which must
# be chosen before triton is first imported. The AOT compilation test clears it in a subprocess.
os.environ.setdefault("TRITON_INTERPRET", "1")
