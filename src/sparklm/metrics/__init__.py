"""What a run records and shows: its rows (rows.py), where they go (sinks.py: metrics.csv, the console, the
driver's channel; trackers/: TensorBoard, MLflow, W&B), what the run loop records (recorder.py: best evaluation,
early stop, the run's result), epochs (epochs.py), loss.png and samples.txt (report.py) and report.html
(html_report.py)."""
