"""``jaxfold serve``: an HTTP inference service for exported or saved folds (see app.py)."""
