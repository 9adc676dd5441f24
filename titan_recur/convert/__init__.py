"""From a pretrained checkpoint to a recurrent model: surgery and the layer analysis behind it."""
