"""Your callbacks: a file here holds a class that subclasses loop.callbacks.Callback, enabled by
`module:Class` in run.callbacks (e.g. run.callbacks=[weight_norm:WeightNorm] for the class
WeightNorm in weight_norm.py). The moments a callback runs at, and what each may do, are listed
in loop/callbacks.py; docs/extending.md walks through writing one.
"""
