"""Population-based training, pure PyTorch: exploit and explore as pure functions and the
scheduler that records every decision (`scheduler`), and the weight average of members
(`soup`)."""
