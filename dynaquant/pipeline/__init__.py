"""The run, one stage a module: ``analyze`` (calibration and measurements -> report.json), ``plan`` (report, preset
or plan.json -> the plan, once per run), ``quantize`` (the one flow: the tensors encoded and handed to a target),
``targets`` (the Target protocol: GGUF file, safetensors checkpoint), ``gptq`` (GPTQ rounding in the loop),
``evaluate`` (the output against its source), ``source`` (source facts the stages share), ``preflight`` (outputs and
budgets checked before any work). ``dynaquant.quantize`` and friends are the face of these modules."""
import dynaquant.kernels  # noqa: F401,E402  (registers the Triton lattice searches as the codecs' fast paths)
