"""The building blocks of a decoder layer, shared by every model in engine/models."""
