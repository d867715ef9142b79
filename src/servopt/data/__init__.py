"""Data a model is measured on: image folders, synthetic inputs (see ``dataset``)."""
