"""`python -m distkit.course.diagrams`: draw the diagrams into images/ (see the package's
docstring)."""
from distkit.course.diagrams import main

main()
