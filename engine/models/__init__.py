"""The models: one module for each architecture the engine serves and what they
share, which class serves which architecture (the registry, whose
SUPPORTED_ARCHITECTURES lists them) and how weights are loaded. What a
checkpoint's config.json says is read in engine/config/model.py."""
