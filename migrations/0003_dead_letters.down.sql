-- placeholder: replaced by the issue that owns this table
SELECT 1;
