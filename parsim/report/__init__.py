"""What parsim shows: the one trace schema, time by phase, tables, Gantt charts, plots and the JSON envelope."""
