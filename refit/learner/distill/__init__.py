"""The distillation job (GKD, supervised KD, sequence-level KD) with the teacher and the student on engines."""
