"""Several processes: the layout and its collectives (layout), model/optimizer wrapping (wrapping), and how
the ranks start (launch)."""
