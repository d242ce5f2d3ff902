"""Canvas tasks (detection and contour recognition on synthetic layouts of real images), pure
PyTorch: the layouts (`layouts`), mAP (`detection`) and boundary F (`contours`)."""
