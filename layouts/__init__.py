"""bitdecode.layouts: the one definition of every data layout (packing, fragments, swizzles).

Built with CuTe layout algebra; evaluated to plain integer tables at trace time, so the
torch reference, the tests and the CLI use exactly what the kernels use.  Imports neither
the public API nor the kernels.
"""

from . import packing, sm80
from .packing import codes_per_word, dequant_steps, interleave

__all__ = ["packing", "sm80", "codes_per_word", "dequant_steps", "interleave"]
