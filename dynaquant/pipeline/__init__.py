"""The run, one stage a module: ``analyze`` (calibration and measurements -> report.json), ``quantize`` (plan,
the tensor loop, the output), ``safetensors`` (the safetensors target), ``preflight`` (outputs and budgets checked
before any work). ``dynaquant.quantize`` and friends are the face of these modules."""

import dynaquant.kernels  # noqa: F401  (registers the Triton lattice searches as the codecs' fast paths)
