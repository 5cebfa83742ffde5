"""The models: one module for each architecture the engine serves and what they
share, the checkpoint's config, which class serves which architecture (the
registry, whose SUPPORTED_ARCHITECTURES lists them) and how weights are loaded."""
