"""HF checkpoint folder -> engine folder: ONNX graphs, their weights and the manifest; it writes and runs nothing."""
