"""Engines behind one protocol (generate, score, update_weights, weights_version, close), the one decode loop,
and the export's parity gate."""
