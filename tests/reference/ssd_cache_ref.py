"""The reference module, vllm-mlx's ``vllm_mlx/ssd_cache.py``, under the name
the tests import (``import ssd_cache_ref as ref``).  Nothing of it is stored
here: importing this module runs reference_loader, which assembles the
reference from the seed in the shared directory beside the repository
(``../shared/seed/ssd_cache_reference.txt``, or ``$KVT_SHARED_DIR/seed/...``)
and executes it in this module's namespace over the MLX and safetensors
stand-ins.  Without the seed the import still succeeds, and using any of the
reference's names raises the reason: a ``seed:``-tagged skip under pytest,
ReferenceUnavailable otherwise.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import reference_loader  # noqa: E402

reference_loader.install(sys.modules[__name__])
