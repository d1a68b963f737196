"""mlx.nn for the stand-in: mlx-lm's cache module names ``nn.Module`` in a
type annotation and uses nothing else from it."""


class Module:
    """Base class of MLX models (annotations only here)."""
