"""Op layer: entry points, backend dispatch and autograd. Knows nothing of Megatron.

Every backend module is imported here, so its custom ops (``msa_megatron::<backend>_*``) are
registered when the package is imported and :func:`.backends.get_backend` never imports inside
code traced by ``torch.compile`` (dynamo cannot trace ``importlib``). Importing the Triton
backend does not import Triton itself (its kernels import it on their first call).
"""

from . import reference_backend, torch_backend, triton  # noqa: F401  registers the custom ops
