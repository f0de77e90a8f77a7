"""The built-in demo's assets; `examples.make_demo` regenerates them and builds tiny test models."""
