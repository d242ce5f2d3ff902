"""Image-text training, pure PyTorch: the weighted multi-description contrastive loss, the
text-initialized classifier and zero-shot heads (`losses`), the captioner (`captioner`), the
measured phrases of an image (`descriptions`) and pool matching (`matching`)."""
