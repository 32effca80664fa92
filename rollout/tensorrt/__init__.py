"""TensorRT in one place (Polygraphy keeps backend/<name>/{loader, runner}): ``build`` (refittable plans with
optimization profiles from the ONNX graphs), ``check`` (the CPU-side checks of an engine folder TensorRT would
build from), ``engine`` (the Engine over the plans, weight pushes through ``trt.Refitter``). ``tensorrt`` itself
is imported only inside functions that need it."""
