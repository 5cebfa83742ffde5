"""`python -m engine.csrc`: build the C++ CPU operators now, as `make test` does."""

from engine.csrc import load

print("C++ CPU operators:", "built" if load() else "unavailable; the torch path is in use")
