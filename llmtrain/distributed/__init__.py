"""Several processes: the layout and its collectives (layout), model/optimizer wrapping (wrapping), and
the CPU cores a process may use (cores). How the ranks start is training's (training/launch.py)."""
