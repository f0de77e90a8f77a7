"""Distribution: Accelerate/DeepSpeed wiring (plugins.py, prepare.py) and reductions across ranks."""
