"""analysis"""

import dynaquant.kernels  # noqa: F401  (registers the Triton lattice searches as the codecs' fast paths)
