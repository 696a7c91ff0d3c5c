"""The model floor's error (weights.py re-exports it, where callers import it from)."""


class ModelLoadError(RuntimeError):
    """The model file or directory is missing, unreadable or not a Llama-family model."""


__all__ = ["ModelLoadError"]
