-- Back to 0014: no tenant quotas.
DROP TABLE IF EXISTS tenant_quotas;
