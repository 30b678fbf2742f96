{{/*
Expand the name of the chart.
*/}}
{{- define "gpuwarden.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name (63 characters at most: some Kubernetes name fields are
limited to that by the DNS naming spec). If the release name contains the chart name it is used as is.
The component suffixes ("-operator", "-operator-ingest", "-agent") are appended to this name, so keep
it at most 47 characters (fullnameOverride / release name) to keep every object name whole.
*/}}
{{- define "gpuwarden.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Name of one component's objects: "<fullname>-<component>". Call with (dict "ctx" $ "component" "operator").
*/}}
{{- define "gpuwarden.componentName" -}}
{{- printf "%s-%s" (include "gpuwarden.fullname" .ctx) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create chart name and version as used by the chart label.
*/}}
{{- define "gpuwarden.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The namespace objects are installed into (overridable for `helm template` pipelines).
*/}}
{{- define "gpuwarden.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels (no component). Call with the root context.
*/}}
{{- define "gpuwarden.commonLabels" -}}
helm.sh/chart: {{ include "gpuwarden.chart" . }}
app.kubernetes.io/name: {{ include "gpuwarden.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpuwarden
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Labels of one component's objects. Call with (dict "ctx" $ "component" "operator").
*/}}
{{- define "gpuwarden.labels" -}}
{{ include "gpuwarden.commonLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Selector labels of one component: immutable once installed (Deployment/DaemonSet selectors), so only
name, instance and component. Call with (dict "ctx" $ "component" "operator").
*/}}
{{- define "gpuwarden.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuwarden.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
ServiceAccount name of one component. Call with (dict "ctx" $ "component" "operator").
*/}}
{{- define "gpuwarden.serviceAccountName" -}}
{{- $sa := (index .ctx.Values .component).serviceAccount }}
{{- if $sa.create }}
{{- default (include "gpuwarden.componentName" .) $sa.name }}
{{- else }}
{{- default "default" $sa.name }}
{{- end }}
{{- end }}

{{/*
Container image reference. Call with (dict "ctx" $ "image" .Values.operator.image); the tag defaults to
the chart's appVersion, and a digest, when set, wins over the tag.
*/}}
{{- define "gpuwarden.image" -}}
{{- $registry := default .image.registry .ctx.Values.global.imageRegistry }}
{{- $repository := .image.repository }}
{{- if $registry }}
{{- $repository = printf "%s/%s" $registry .image.repository }}
{{- end }}
{{- if .image.digest }}
{{- printf "%s@%s" $repository .image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default .ctx.Chart.AppVersion .image.tag | toString) }}
{{- end }}
{{- end }}

{{/*
Names and ports shared between the operator, its Services and the agent (docs/deployment-contract.md).
*/}}
{{- define "gpuwarden.operator.serviceName" -}}
{{- include "gpuwarden.componentName" (dict "ctx" . "component" "operator") }}
{{- end }}

{{- define "gpuwarden.operator.ingestServiceName" -}}
{{- include "gpuwarden.componentName" (dict "ctx" . "component" "operator-ingest") }}
{{- end }}

{{/*
URL the agents POST their reports to: the ingest Service, which selects only the active replica
(https:// with tls.enabled).
*/}}
{{- define "gpuwarden.agent.operatorURL" -}}
{{- if .Values.agent.operatorURL }}
{{- .Values.agent.operatorURL }}
{{- else }}
{{- printf "%s://%s:%d/v1/reports" (ternary "https" "http" .Values.tls.enabled) (include "gpuwarden.tls.serverName" .) (int .Values.operator.ingest.port) }}
{{- end }}
{{- end }}

{{/*
Kopf peering object name (--peering): operator.peering.name, or the release's full name, so two
releases in one cluster never share a ClusterKopfPeering (a release named "gpuwarden" gets "gpuwarden",
the operator's default).
*/}}
{{- define "gpuwarden.operator.peeringName" -}}
{{- default (include "gpuwarden.fullname" .) .Values.operator.peering.name }}
{{- end }}

{{/*
Whether the operator watches all namespaces (no operator.watchNamespaces given).
*/}}
{{- define "gpuwarden.operator.clusterWide" -}}
{{- if not .Values.operator.watchNamespaces }}true{{- end }}
{{- end }}

{{/*
`job` label Prometheus gives the scrape of one component: the Service name with a ServiceMonitor,
"<namespace>/<PodMonitor name>" with a PodMonitor. Call with (dict "ctx" $ "component" "agent").
*/}}
{{- define "gpuwarden.monitoring.job" -}}
{{- $name := include "gpuwarden.componentName" . }}
{{- if .ctx.Values.monitoring.podMonitor.enabled }}
{{- printf "%s/%s" (include "gpuwarden.namespace" .ctx) $name }}
{{- else }}
{{- $name }}
{{- end }}
{{- end }}

{{/*
Whether the agent reads the API server: the pod list (agent.podList.enabled) or the node's ResourceSlices
(agent.dra.resourceSlices with a DRA driver named). Its token is mounted, and its ClusterRole bound, only then.
*/}}
{{- define "gpuwarden.agent.apiAccess" -}}
{{- $agent := .Values.agent -}}
{{- if or $agent.podList.enabled (and $agent.dra.resourceSlices $agent.dra.drivers) -}}true{{- end -}}
{{- end }}

{{/*
Whether the operator uses Kopf peering (one acting replica): not in sharded mode, which uses Leases.
*/}}
{{- define "gpuwarden.operator.kopfPeering" -}}
{{- if not .Values.operator.sharding.enabled }}true{{- end }}
{{- end }}

{{/*
TLS of the report path (tls.*): the Secret holding tls.crt, tls.key and ca.crt, and the name the
agents (and sharded replicas) check the operator's certificate for: the ingest Service's.
*/}}
{{- define "gpuwarden.tls.secretName" -}}
{{- default (include "gpuwarden.componentName" (dict "ctx" . "component" "operator-tls")) .Values.tls.existingSecret }}
{{- end }}

{{- define "gpuwarden.tls.serverName" -}}
{{- printf "%s.%s.svc" (include "gpuwarden.operator.ingestServiceName" .) (include "gpuwarden.namespace" .) }}
{{- end }}

{{/*
The DNS names of the operator's certificate: the ingest Service's, short to fully qualified.
*/}}
{{- define "gpuwarden.tls.dnsNames" -}}
{{- $svc := include "gpuwarden.operator.ingestServiceName" . }}
{{- $ns := include "gpuwarden.namespace" . }}
{{- toJson (list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns)) }}
{{- end }}

{{/*
The agent's TLS flags (with tls.enabled): the CA from the operator's Secret, and the Service's name,
checked on every replica a sharded operator redirects reports to (at its pod IP).
*/}}
{{- define "gpuwarden.agent.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --operator-ca-file=/etc/gpuwarden/operator-ca/ca.crt
- --operator-server-name={{ include "gpuwarden.tls.serverName" . }}
{{- end }}
{{- end }}

{{/*
Who may scrape the metrics ports (networkPolicy.metrics): pods of the monitoring namespaces, or only
those of them that networkPolicy.metrics.podSelector picks.
*/}}
{{- define "gpuwarden.networkPolicy.metricsFrom" -}}
{{- $metrics := .Values.networkPolicy.metrics -}}
- namespaceSelector:
    matchLabels:
      {{- toYaml $metrics.namespaceSelector | nindent 6 }}
  {{- with $metrics.podSelector }}
  podSelector:
    matchLabels:
      {{- toYaml . | nindent 6 }}
  {{- end }}
{{- end }}

{{/*
PriorityClass of the agent pods: agent.priorityClassName, else the chart's own when it creates one.
*/}}
{{- define "gpuwarden.agent.priorityClassName" -}}
{{- if .Values.agent.priorityClassName }}
{{- .Values.agent.priorityClassName }}
{{- else if .Values.agent.priorityClass.create }}
{{- include "gpuwarden.componentName" (dict "ctx" . "component" "agent") }}
{{- end }}
{{- end }}
