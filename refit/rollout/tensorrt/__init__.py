"""TensorRT in one place (Polygraphy keeps backend/<name>/{loader, runner}): ``build`` (refittable plans with
optimization profiles from the ONNX graphs), ``check`` (the CPU-side checks of an engine folder TensorRT would
build from: ``check_graph`` for ops and shape profiles, ``check_weights`` for the weight map, Q/DQ and foldable
weights), ``runner`` (one graph's plan, execution context, profiles and aligned bindings), ``engine`` (the Engine
over the plans, weight pushes through ``trt.Refitter``), ``gate`` (the built plans' parity gate). ``tensorrt``
itself is imported only inside functions that need it."""
