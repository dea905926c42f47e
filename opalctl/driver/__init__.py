"""The formal run: budget clocks and accounting, promotion, and the loop that ties them to a task."""
