"""Stage-wise distillation, pure PyTorch: the losses and the student's step (`losses`), the
multi-state teacher feature bank (`feature_bank`), the recency data queue (`data_queue`) and
the stage driver that draws from it (`stages`)."""
