"""The worker side: one process per model instance, loading the model and running inference on its device."""
