"""Serving: the Open Inference Protocol v2 server, dynamic batching, load testing, packaging.

Nothing here imports torch: ``pip install servopt[serve]`` serves ONNX and OpenVINO artifacts.
"""
