"""Investigations: each folder asks one question and holds its script, results and README
(question, method, answer, commit). Folders with an underscore are packages, run as
``python -m sparseflash.experiments.studies.<topic>.<script>``; the others run their scripts by path."""
