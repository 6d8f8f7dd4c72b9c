"""The incident desk: a detection opened as a case, the ranks' reports merged into one report and
its files, and a rank left behind fenced out."""
