-- Back to 0001's notification without a payload: every relay wakes.
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('kvmesh_outbox', '');
    RETURN NULL;
END;
$$;
