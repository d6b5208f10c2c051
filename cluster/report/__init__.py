"""The analyst's report: built from traces alone, rendered as tables and a plot."""
