"""Layer 3, using a trained model: the model directory and ``load_model`` (``model_dir``), predictions over
a prepared split or raw inputs (``predict``, ``predict_inputs``) and export (``export``). Imports the layers
below (loading, models, tasks, inputs, data, util), never ``mmfast.train`` or ``mmfast.cli``."""
