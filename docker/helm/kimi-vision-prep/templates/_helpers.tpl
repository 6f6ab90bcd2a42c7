{{- define "kvp.name" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvp.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvp.labels" -}}
{{ include "kvp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The ports kimi-prep serve listens on (its defaults; tests/test_helm_chart.py checks them). */}}
{{- define "kvp.ports" -}}
http: 8000
grpc: 8001
metrics: 8002
probes: 8003
{{- end -}}
