"""Produces records with confluent-kafka's own AvroSerializer, the bytes a
real upstream's client writes (Confluent wire format, schema registered
in the registry under <topic>-value). The tests run it with the venv that
`scripts/stack install` makes (install_python_producers).

  produce_registry.py BROKERS REGISTRY_URL TOPIC SCHEMA_FILE < records.jsonl

Each input line is one record as JSON; strings of the fields named in the
schema as Avro decimals become decimal.Decimal (exact), as an upstream's
own values would be.
"""
import decimal
import json
import sys

from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext


def decimal_fields(schema):
    names = set()
    for f in schema.get("fields", []):
        t = f["type"]
        branches = t if isinstance(t, list) else [t]
        for b in branches:
            if isinstance(b, dict) and b.get("logicalType") == "decimal":
                names.add(f["name"])
    return names


def main():
    brokers, registry, topic, schema_file = sys.argv[1:5]
    schema_str = open(schema_file).read()
    decimals = decimal_fields(json.loads(schema_str))
    client = SchemaRegistryClient({"url": registry})
    serializer = AvroSerializer(client, schema_str, lambda obj, ctx: obj)
    producer = Producer({"bootstrap.servers": brokers, "enable.idempotence": True})
    ctx = SerializationContext(topic, MessageField.VALUE)
    count = 0
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        record = json.loads(line)
        for name in decimals:
            if isinstance(record.get(name), str):
                record[name] = decimal.Decimal(record[name])
        producer.produce(topic, value=serializer(record, ctx))
        count += 1
    if producer.flush(30) != 0:
        sys.exit("not every record was acknowledged")
    print(count)


if __name__ == "__main__":
    main()
