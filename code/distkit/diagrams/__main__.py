"""`python -m distkit.diagrams`: draw the diagrams into images/ (see the package's docstring)."""
from distkit.diagrams import main

main()
