"""A numpy stand-in for the parts of Apple's MLX that the upstream client code
(mlx-lm's cache classes, vllm-mlx's prefix cache and scheduler) touches, so the
real-client tests can run that code unchanged on Linux.  Only this package is
ours; mlx.core holds the array type and operations, mlx.utils the tree helpers,
mlx.nn is present because mlx-lm imports it."""
