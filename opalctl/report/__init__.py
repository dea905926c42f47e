"""The report page: one self-contained, offline HTML file per lock (``grid_page``) or run (``run_page``), its
figures drawn by matplotlib's Agg backend as inline SVG (``figures``), from the runs' records (``runs``)."""
