"""Small helpers every layer may use: shipped project folders, progress bars, plots."""
