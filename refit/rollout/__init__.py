"""Engines behind one protocol (generate, score, update_weights, weights_version, manifest, adapter, adapter_off,
close: everything the learner reads of an engine), the one decode loop, and the export's parity gate."""
