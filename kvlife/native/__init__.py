"""kvlife's compiled code: small C extensions built with the package (``setup.py``),
each with a Python module here that loads it, checks it and says whether it is there."""
