"""jinja2 templates of the rendered jobs (sbatch scripts)."""
